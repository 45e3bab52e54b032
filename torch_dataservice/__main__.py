"""`python -m torch_dataservice dispatcher|worker ...`"""

import sys

from torch_dataservice.cli import main

sys.exit(main())

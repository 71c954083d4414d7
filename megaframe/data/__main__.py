"""`python -m megaframe.data verify PATH`: see megaframe.data.verify."""

import sys

from megaframe.data.verify import main

sys.exit(main(sys.argv[1:]))

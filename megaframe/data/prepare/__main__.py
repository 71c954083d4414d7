"""`python -m megaframe.data.prepare`: see megaframe.data.prepare."""

import sys

from megaframe.data.prepare import main

sys.exit(main())

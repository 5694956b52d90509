"""``python -m anyaccel.cli``: the ``anyaccel`` command, for where its console script is not on ``PATH``.

The package's ``main`` runs, so exception classes (``CLIError``) are the same objects the
sub-commands raise.
"""

import sys

from . import main

sys.exit(main())

import sys

from kvfence_cli.main import main

sys.exit(main())

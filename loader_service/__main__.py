import sys

from loader_service.cli.main import main

sys.exit(main())

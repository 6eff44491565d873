import sys

from prefetcher.core import main

sys.exit(main())

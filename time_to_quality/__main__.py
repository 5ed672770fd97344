"""`python -m time_to_quality ...`: the ladder (ladder.main; its flags in --help)."""
import sys

from .ladder import main

if __name__ == '__main__':  # not when a --workers process imports this as its parent's main module
    sys.exit(main())

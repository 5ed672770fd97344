"""`python scripts/ladder_report.py ...` is `python -m time_to_quality.recompute ...` (kept for the commands of old)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from time_to_quality.recompute import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())

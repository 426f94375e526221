"""`python -m model generate ...` / `python -m model plan-memory ...`."""
from model.cli import main

raise SystemExit(main())

from k3gen.cli import main

raise SystemExit(main())

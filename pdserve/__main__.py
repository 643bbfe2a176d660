from pdserve.cli import main

raise SystemExit(main())

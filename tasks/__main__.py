from tasks.cli import main

raise SystemExit(main())

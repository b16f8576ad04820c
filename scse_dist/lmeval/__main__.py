from scse_dist.lmeval.cli import main

raise SystemExit(main())

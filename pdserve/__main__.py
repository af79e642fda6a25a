from pdserve.cluster.cli import main

raise SystemExit(main())

from lorafleet.cli import main

raise SystemExit(main())

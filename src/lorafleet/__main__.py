from lorafleet.cli import main

if __name__ == "__main__":  # not when a spawned child process re-imports this module as __mp_main__
    raise SystemExit(main())

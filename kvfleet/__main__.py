from kvfleet.cli import main

main()

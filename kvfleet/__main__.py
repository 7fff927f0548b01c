from kvfleet.cli import main

# Guarded: multiprocessing's spawn start method (the long-context benchmark's) imports this module again.
if __name__ == "__main__":
    main()

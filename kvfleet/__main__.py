from kvfleet.cli import main

# Guarded: the engine core process is started with multiprocessing's spawn, which imports this module again.
if __name__ == "__main__":
    main()

"""The event schema and the discrete-event engine (engine.py: SimPy's discipline, kept without its objects;
simpy_engine.py: the same on SimPy itself, `--simulator simpy`): op graph in, exact allocate/free event log out."""

"""The event schema and the discrete-event engine (SimPy's discipline, kept without its objects; tests/
simpy_reference.py runs SimPy itself against it): op graph in, exact allocate/free event log out."""

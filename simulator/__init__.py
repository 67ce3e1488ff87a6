"""The SimPy engine and the event schema: op graph in, exact allocate/free event log out."""

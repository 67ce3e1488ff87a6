"""A resident `peakledger` for commands that would spend most of their time importing torch and transformers:
`peakledger serve` imports them once and forks itself for each command (server.py); the `peakledger` command hands
its command line, working folder, environment and streams to it where one is up (client.py, launch.py), else runs
the command itself. protocol.py is what both sides say, and where they meet."""

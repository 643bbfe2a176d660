"""``pdserve up``: a local P/D cluster of real server processes on 127.0.0.1.

Reading path: ``up.py`` (the command: start, wait ready, print the endpoint, drain on
Ctrl-C), then ``supervisor.py`` (restart a dead server with backoff on the same ports; add
one, drain one), then ``autoscale.py`` (``--autoscale``: the planner's loop over the
processes). This package only starts and watches processes; it imports no server code.
"""

"""kvconn's tools: the command line, model presets, the simulator, store inspection and
development servers.

They sit apart from the library core (``kvconn.*``) so that an engine importing the
connector pays for none of them, and so that the core never depends on a tool.
"""

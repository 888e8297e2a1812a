"""The errors a stage reports as one line and a non-zero exit: the input is wrong (params, files, records, servers,
a gate), not the code. Anything else that escapes a stage is a bug and keeps its traceback."""


class UserError(Exception):
    """Its message names what to fix: the file and line, the params key, the server, the gate."""

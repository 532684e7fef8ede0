"""Tools the model can call: small objects with a name, a JSON schema and `run`.

base.py: the Tool protocol, ToolContext and the registry; bash.py: the streaming bash.
Imports store/ models and errors; never runtime/ or api/ (the turn hands tools a context).
"""

"""The SGLang test double that tests/sglang_server.py runs (its docstring describes the protocol it speaks):
protocol.py its constants, knobs and SGLang's request rules, server.py the server and its endpoints but /generate,
generate.py /generate with its faults, control.py driving the server from another process."""

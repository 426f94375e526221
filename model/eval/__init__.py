"""The accuracy harness (`python -m model eval`, docs/ACCURACY.md): fp32.py (the FP32 reference path by
teacher forcing), serve.py (one serving setting on K3Model), report.py (exact match, intervals, table,
JSON, PNG), command.py (the command)."""

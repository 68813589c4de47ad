"""The in-process front end: engine (tokenize, detokenize, stop strings, outputs), the asyncio
bridge to the server, admission, the offline ``LLM`` entry point, trace replay and the
in-process prefill/decode pair."""

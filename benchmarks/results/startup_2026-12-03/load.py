"""Seconds to import specserve, then to make the default engine on the CPU (``LLM()``)."""
import time

start = time.perf_counter()
from specserve import LLM

imported = time.perf_counter()
llm = LLM(device="cpu")
made = time.perf_counter()
print(f"import {imported - start:.2f}s  LLM() {made - imported:.2f}s")

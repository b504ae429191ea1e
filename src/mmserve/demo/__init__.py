"""The bundled demo: a synthetic shapes task (`shapes`) and its accuracy eval through the engine (`eval`).

Role: give mmserve a tiny Qwen2-VL that really sees, and a way to measure it. What it does not know:
how the demo model was trained (see scripts/train_demo_model.py).
"""

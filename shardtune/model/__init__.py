"""The model: loading, presets and saving, structure checks, attention, loss, FLOPs and memory formulas, PEFT and
quantized loading, long-sequence levers, speed features, llama-cookbook's model flags, generation."""

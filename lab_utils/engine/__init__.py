"""The serving engine, read top to bottom: LLMEngine.step() -> Scheduler.schedule() (uses BlockManager)
-> ModelRunner.run() -> Sampler -> outputs with per-token timestamps."""

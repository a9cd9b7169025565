"""A cluster you do not have, simulated: datasheet GPUs (`gpus`), a roofline step-time model (`cost_model`), a
discrete-event simulator that drives the engine's own Scheduler and BlockManager (`simulator`), the fit of
this machine's effective speed against the real engine (`calibrate`), and a prefill's cost on this device fitted
from timed prefills (`prefill_cost`)."""
from lab_utils.sim.cost_model import ModelSpec, StepCost, allreduce_time, kv_capacity, model_spec, step_cost
from lab_utils.sim.gpus import GPUS, Hardware, gpu

__all__ = ["GPUS", "Hardware", "ModelSpec", "StepCost", "allreduce_time", "gpu", "kv_capacity", "model_spec",
           "step_cost"]

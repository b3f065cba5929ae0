"""Engine: request state, paged KV pool, planner, scheduler, sampler, model runner and step loop."""

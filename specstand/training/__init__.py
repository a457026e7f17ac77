"""Training trained drafters on the target's own answers: data (the target answers a workload), features
(the frozen target's hidden states, computed inside the loop), losses, the trainer and the evaluation."""

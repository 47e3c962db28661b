"""Policy objectives, advantages, rollout batches, the learner, MIPU and SFT: the algorithm."""

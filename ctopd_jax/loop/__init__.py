"""The loop layer: the iteration (trainer.py) and the parts it is built from and drives: build.py
(models on the mesh, tokenizer sides, the engine, the prompt stream), objective_factory.py,
teacher_batches.py, checkpoint.py (Orbax state, HF export), offload.py (optimizer state in host
memory during the rollout), mean_at_k.py (evaluation: K graded samples per problem)."""

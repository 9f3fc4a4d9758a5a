"""The step layer between the loop and the objectives: the micro-batch gradient and the optimizer
update (grad.py), batch shards (shards.py) and the gradient diagnostics (diagnostics.py).
The objectives never import it; it drives them through the contract in algorithms/base.py."""

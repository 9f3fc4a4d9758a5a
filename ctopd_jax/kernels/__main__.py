"""`python -m ctopd_jax.kernels RESULT.json`: write the rows a GPU check measured into the
kernels' tables of measured choices (kernels/choices.py; the package, not the module, is the
command because importing ctopd_jax already imports kernels.choices)."""
import sys

from ctopd_jax.kernels.choices import main

sys.exit(main())

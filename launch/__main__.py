"""``python -m launch``: the same as the ``deepspeed-atlas`` console script."""

from launch.run.runner import main

main()

"""``python -m launch``: the same as the ``deepspeed-atlas`` console script."""

from launch.runner import main

main()

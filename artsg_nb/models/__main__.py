"""`python -m artsg_nb.models NAME [DIR]` (a registered pretrained model) or
`python -m artsg_nb.models tiny [DIR] [--size 0.5b] [--ship]` (a tiny model built from scratch) or
`python -m artsg_nb.models random --shape 1.5b|7b|14b [DIR]` (a benchmark model: random weights at a
real model's shape, rewards meaningless)."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["tiny"]:
        from .tiny import main
        raise SystemExit(main(sys.argv[2:]))
    if sys.argv[1:2] == ["random"]:
        from .random_model import main
        raise SystemExit(main(sys.argv[2:]))
    from .pretrained import main
    raise SystemExit(main())

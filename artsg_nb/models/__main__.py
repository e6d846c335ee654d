"""`python -m artsg_nb.models NAME [DIR]` (a registered pretrained model) or
`python -m artsg_nb.models tiny [DIR] [--size 0.5b] [--ship]` (a tiny model built from scratch)."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["tiny"]:
        from .tiny import main
        raise SystemExit(main(sys.argv[2:]))
    from .pretrained import main
    raise SystemExit(main())

"""Print the pip requirements of a conda environment file, one per line.

The conda files are the single source of truth for dependencies; `make venv` feeds this output
to pip where conda is absent. Lines tagged `# gpu` are kept only with --gpu. It reads the
`- pip:` block only (the conda part is python and pip) and needs no YAML library, so it runs on
a bare interpreter before anything is installed.
"""
import sys


def pip_requirements(path: str, gpu: bool) -> list[str]:
    reqs, in_pip, pip_indent = [], False, 0
    for raw in open(path):
        line = raw.rstrip("\n")
        stripped = line.strip()
        if stripped.startswith("- pip:"):
            in_pip, pip_indent = True, len(line) - len(line.lstrip())
            continue
        if not in_pip or not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= pip_indent:
            break
        spec, _, comment = stripped[2:].partition("#")
        if comment.strip() == "gpu" and not gpu:
            continue
        reqs.append(spec.strip())
    return reqs


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    print("\n".join(pip_requirements(args[0], gpu="--gpu" in sys.argv)))

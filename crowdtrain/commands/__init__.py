"""One typer sub-app per area, mounted by crowdtrain.cli."""

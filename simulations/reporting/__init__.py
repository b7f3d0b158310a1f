"""What the simulator commands show and write: tables, CSV and JSON files, plots, progress bars."""

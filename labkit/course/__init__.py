"""The course on top: reports, panels, exercises, plots, the planner, the doctor. Imports
everything below it; nothing below imports it."""

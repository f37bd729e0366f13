"""The parts of the dashboards ``dashboards/build.py`` builds: the queries, the panels and their
JSON, the rows more than one dashboard shows, and one module per dashboard."""

"""The spool core: the file and who may trust it, its schema, its one writer, its rows
and how they are read a page at a time. Only this package reads or writes the spool's
tables."""

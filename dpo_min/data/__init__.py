"""The data: files, folders and datasets names read (sources, folders) into validated preference pairs (pairs, entry:
loading), the published layouts they come in (layouts, labelled, options), what a stream drops (streams), held-out
pairs also trained on (overlap), mixtures in their three published forms (mixtures). Tokenizing is the core's."""

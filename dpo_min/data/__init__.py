"""The data: files, folders and datasets names read into validated preference rows (loading), the
published layouts they come in (layouts), mixtures in their three published forms (mixtures)."""

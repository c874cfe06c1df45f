"""``layout``: an ImageFolder from names alone (an object store's keys) is the local scan's
classes, samples and order for the same tree."""

from __future__ import annotations

from loader_service.sources.imagefolder import ImageFolderSource, layout
from testkit.stores import write_image_folder

NAMES = ["b/z.jpg", "b/sub/a.jpg", "b/a.PNG", "a/2.jpeg", "a/10.jpg", "a/x/y/z.jpg", "a/x/b.jpg", "a/notes.txt",
         ".git/c.jpg", "top.jpg", "c/readme.md", "b/sub2/q.webp"]


def test_the_names_of_a_tree_make_the_local_scans_samples_in_its_order(tmp_path):
    write_image_folder(str(tmp_path), {n: k for k, n in enumerate(NAMES)})
    local = ImageFolderSource.scan(str(tmp_path))
    try:
        classes, picked, labels = layout(NAMES)
        assert classes == local._last_listing.classes == ["a", "b", "c"]
        assert [NAMES[i] for i in picked] == [local.paths[i] for i in range(len(local))]
        assert labels == local.labels.tolist()
    finally:
        local.close()


def test_store_only_names_a_folder_marker_is_a_class_an_empty_segment_no_sample():
    classes, picked, labels = layout(["cat/", "dog//x.jpg", "dog/y.jpg"])
    assert classes == ["cat", "dog"] and picked == [2] and labels == [1]
    assert layout(["x.jpg", ".h/y.jpg"]) == ([], [], [])

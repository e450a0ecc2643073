from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("finetuning", "0012_job_parent_revision")]

    operations = [
        migrations.AddField(model_name="file", name="format", field=models.CharField(default="chat", max_length=16)),
        migrations.AddField(
            model_name="finetuningjob", name="method", field=models.CharField(default="supervised", max_length=16)
        ),
    ]
